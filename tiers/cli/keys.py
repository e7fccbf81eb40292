"""``keys generate DIR``: CurveZMQ certificates for tcp:// endpoints (tiers/wire/security.py);
``keys page-key FILE``: the AES-256-GCM key an engine seals its pages with (hicache_ext/sealing.py)."""
from __future__ import annotations

import os
import secrets
import sys


def register(sub) -> None:
    p = sub.add_parser("keys", help="CurveZMQ keys for tcp:// endpoints",
                       description="Manage the CurveZMQ certificates that authenticate and encrypt tcp:// "
                                   "endpoints (pools, tiers served over the network).")
    keys = p.add_subparsers(dest="keys_command", metavar="ACTION")
    g = keys.add_parser("generate", help="write server and client key pairs into DIR",
                        description="Write server.key/server.key_secret and client.key/client.key_secret "
                                    "(secret files mode 0600, DIR mode 0700). Then set in [node]: "
                                    "curve_server_key = \"DIR/server.key_secret\" on the serving node, "
                                    "\"DIR/server.key\" on clients, curve_client_key = \"DIR/client.key_secret\"; "
                                    "a server admits the *.key files of curve_authorized_keys (default the "
                                    "directory of curve_client_key). Exit codes: 0 written, 1 cannot write or "
                                    "files exist, 2 usage.")
    g.add_argument("dir", metavar="DIR", help="directory for the certificate files (created 0700)")
    g.add_argument("--name", action="append", metavar="NAME",
                   help="a key pair to write (repeatable; default: server and client)")
    g.add_argument("--force", action="store_true", help="replace existing files")
    g.set_defaults(func=cmd_generate)
    k = keys.add_parser("page-key", help="write a random page key into FILE (mode 0600)",
                        description="Write a random 32-byte AES-256-GCM key, as 64 hex digits, into FILE (created "
                                    "mode 0600; it must stay readable by the engine's account only). Name it in the "
                                    "backend's extra config as \"page_key_file\": every page is then sealed in the "
                                    "engine's process before any tier sees it. Exit codes: 0 written, 1 cannot "
                                    "write or FILE exists, 2 usage.")
    k.add_argument("file", metavar="FILE", help="the key file to create")
    k.add_argument("--force", action="store_true", help="replace an existing file (its pages become misses)")
    k.set_defaults(func=cmd_page_key)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def cmd_generate(args) -> int:
    from tiers.wire.security import generate
    names = tuple(args.name or ("server", "client"))
    for name in names:
        if not name or os.sep in name or name.startswith(".") or not name.replace("-", "").replace("_", "").isalnum():
            print(f"hicache-tiers: key name {name!r} must be letters, digits, - and _", file=sys.stderr)
            return 2
    try:
        files = generate(args.dir, names, force=args.force)
    except (OSError, FileExistsError) as exc:
        print(f"hicache-tiers: cannot write keys: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(f"wrote {path}")
    return 0


def cmd_page_key(args) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_TRUNC if args.force else os.O_EXCL)
    try:
        fd = os.open(args.file, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (secrets.token_bytes(32).hex() + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        print(f"hicache-tiers: cannot write {args.file}: {exc.strerror}"
              + (" (--force replaces it)" if isinstance(exc, FileExistsError) else ""), file=sys.stderr)
        return 1
    print(f"wrote {args.file}")
    return 0
