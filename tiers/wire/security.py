"""CurveZMQ on tcp:// endpoints: key files, which endpoint uses which keys, and the daemon's admission.

Local endpoints (ipc://) are guarded by the file system: the runtime directory
is 0700 and every socket in it 0600.  A tcp:// endpoint is reachable by
anyone who can route to it, so a daemon serving one requires CurveZMQ: the
connection is encrypted and a client is admitted only when its public key is
one of the authorized keys.  Without keys the daemon refuses to start unless
``allow_insecure_tcp = true`` says the operator accepts an open port.

Node keys (``[node]`` of the TOML file, shared by the node's daemons, the
SGLang backend and the CLI):
- ``curve_server_key``: the server certificate; the secret file (``*.key_secret``)
  on the node that serves tcp://, the public file (``*.key``) is enough for a client.
- ``curve_client_key``: the client's secret certificate (``*.key_secret``).
- ``curve_authorized_keys``: a directory of client public certificates
  (``*.key``) a server admits; default the directory of ``curve_client_key``.
- ``allow_insecure_tcp``: serve tcp:// without CurveZMQ (a closed test network only).
``hicache-tiers keys generate DIR`` writes server and client pairs (tiers/cli/keys.py).

A configuration's tiers carry their settings (``TierConfig.curve``); every
daemon and client is handed them explicitly, so two configurations in one
process never see each other's keys.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

import zmq

from tiers.logs import RateLimitedLog

log = logging.getLogger("hicache.security")
_warn = RateLimitedLog(log)

ZAP_DOMAIN = "hicache-tiers"
_MAX_KEY_FILE_BYTES = 4096


class KeyFileError(ValueError):
    """A key file that is missing, unreadable, malformed or too open."""


@dataclass(frozen=True)
class CurveSettings:
    """The CurveZMQ settings of one node configuration."""

    server_key: str = ""  # server certificate file (secret on a server; public suffices on a client)
    client_key: str = ""  # client secret certificate file
    authorized_keys: str = ""  # directory of admitted client public certificates
    allow_insecure_tcp: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.server_key)


def generate(directory: str, names: Tuple[str, ...] = ("server", "client"), force: bool = False) -> List[str]:
    """Write NAME.key (public) and NAME.key_secret (0600) for each name into directory (0700); the files."""
    import zmq.auth

    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    written = []
    for name in names:
        targets = [os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")]
        existing = [t for t in targets if os.path.exists(t)]
        if existing and not force:
            raise FileExistsError(f"{existing[0]} exists (pass --force to replace it)")
        old = os.umask(0o077)
        try:
            public, secret = zmq.auth.create_certificates(directory, name)
        finally:
            os.umask(old)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        written += [public, secret]
    return written


def load_key_file(path: str, need_secret: bool) -> Tuple[bytes, Optional[bytes]]:
    """(public, secret) of a ZeroMQ certificate file; KeyFileError with the reason when unusable."""
    import zmq.auth

    try:
        st = os.stat(path)
    except OSError as exc:
        raise KeyFileError(f"key file {path}: {exc.strerror}") from None
    if st.st_size > _MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"key file {path}: {st.st_size} bytes is not a ZeroMQ certificate")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"key file {path}: {exc}") from None
    if need_secret:
        if secret is None:
            raise KeyFileError(f"key file {path} holds no secret key (use the .key_secret file)")
        if st.st_mode & 0o077:
            raise KeyFileError(f"key file {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise KeyFileError(f"key file {path}: a key is not 40 Z85 characters")
    return public, secret


def load_authorized(directory: str) -> FrozenSet[bytes]:
    """Public keys of every *.key certificate in directory."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise KeyFileError(f"authorized keys directory {directory}: {exc.strerror}") from None
    keys = set()
    for name in names:
        if name.endswith(".key"):
            keys.add(load_key_file(os.path.join(directory, name), need_secret=False)[0])
    if not keys:
        raise KeyFileError(f"authorized keys directory {directory} holds no *.key certificate")
    return frozenset(keys)


# ------------------------------------------------------------ client side

def client_keys(settings: Optional[CurveSettings], endpoint: str) -> Optional[Tuple[bytes, bytes, bytes]]:
    """(client public, client secret, server public) for a tcp:// endpoint, or None (plain)."""
    if not endpoint.startswith("tcp://") or settings is None or not settings.enabled or not settings.client_key:
        return None
    try:
        public, secret = load_key_file(settings.client_key, need_secret=True)
        server_public, _ = load_key_file(settings.server_key, need_secret=False)
    except KeyFileError as exc:
        _warn.warning(f"client-key:{endpoint}", "cannot use CurveZMQ keys for %s: %s; connecting in the clear "
                      "(the daemon will refuse)", endpoint, exc)
        return None
    return public, secret, server_public


def refused_before_heard(settings: Optional[CurveSettings], endpoint: str) -> str:
    """Why a client of endpoint with these settings is refused before the daemon hears it ("" when it is not):
    a CurveZMQ server and no client key here (a pool's own node configured as a server only)."""
    if endpoint.startswith("tcp://") and settings is not None and settings.enabled and not settings.client_key:
        return ("tcp:// with CurveZMQ, and this configuration has no node.curve_client_key: the daemon, up or "
                "not, refuses clients without keys; set curve_client_key to a key its curve_authorized_keys admits")
    return ""


def apply_client(sock: zmq.Socket, endpoint: str, settings: Optional[CurveSettings]) -> None:
    """Set a DEALER's curve options when endpoint is a tcp:// endpoint with keys (before connect)."""
    keys = client_keys(settings, endpoint)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys


# ------------------------------------------------------------ server side

class Admission:
    """CurveZMQ admission of one daemon: pyzmq's ThreadAuthenticator answers ZAP, asking this which keys pass.

    The authenticator runs in its own thread (pyzmq's), so a daemon loop busy
    with a large batch still answers handshakes. Handshakes that fail before
    ZAP is asked (a client without keys, or with the wrong server key) are
    seen through the router's monitor socket, which the daemon's connection guard
    reads (tiers/node/connections.py) and hands to ``handshake_failed``.
    """

    def __init__(self, context: zmq.Context, authorized: FrozenSet[bytes], name: str):
        from zmq.auth.thread import ThreadAuthenticator

        self.authorized = authorized
        self.name = name
        self.admitted = 0
        self.refused = 0
        self._authenticator = ThreadAuthenticator(context, log=log.getChild("zap"))
        self._authenticator.start()  # binds the ZAP endpoint of this context
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """pyzmq's credentials-provider hook: True admits the client with this Z85 public key."""
        if client_key in self.authorized:
            self.admitted += 1
            return True
        self.refused += 1
        _warn.warning(f"zap:{self.name}", "tier %s refused a connection: client key %s... not authorized",
                      self.name, client_key[:8].decode("ascii", "replace"))
        return False

    def handshake_failed(self, event: dict) -> None:
        """A handshake that failed before ZAP was asked (a client without CurveZMQ keys, or with the wrong
        server key), as the router's monitor reported it (tiers/node/connections.py: one monitor a socket)."""
        self.refused += 1
        _warn.warning(f"handshake:{self.name}", "tier %s refused a connection: CurveZMQ handshake failed "
                      "(event %d, value %d; a client without keys or with the wrong server key)",
                      self.name, event["event"], event["value"])

    def close(self) -> None:
        self._authenticator.stop()


def secure_router(router: zmq.Socket, context: zmq.Context, endpoint: str, name: str,
                  settings: CurveSettings) -> Optional[Admission]:
    """Make a ROUTER about to bind endpoint a CurveZMQ server; its Admission (None: plain).

    ValueError (the daemon then refuses to start) for a tcp:// endpoint without
    keys unless allow_insecure_tcp, and for unusable key files.
    """
    if not endpoint.startswith("tcp://"):
        return None
    if not settings.enabled:
        if settings.allow_insecure_tcp:
            log.warning("tier %s serves %s WITHOUT authentication or encryption (allow_insecure_tcp = true)",
                        name, endpoint)
            return None
        raise ValueError(f"{endpoint} is a tcp:// endpoint and no CurveZMQ keys are configured: set "
                         f"node.curve_server_key (hicache-tiers keys generate DIR) or allow_insecure_tcp = true")
    public, secret = load_key_file(settings.server_key, need_secret=True)
    authorized_dir = settings.authorized_keys or os.path.dirname(os.path.abspath(settings.client_key or settings.server_key))
    # The server's own certificate often sits in the same directory (keys generate writes both): it
    # names this server, not a client, so it admits nobody.
    authorized = load_authorized(authorized_dir) - {public}
    if not authorized:
        raise KeyFileError(f"authorized keys directory {authorized_dir} holds no client certificate "
                           f"(only the server's own key)")
    admission = Admission(context, authorized, name)
    router.curve_server = True
    router.curve_publickey = public
    router.curve_secretkey = secret
    router.zap_domain = ZAP_DOMAIN.encode()
    log.info("tier %s: CurveZMQ on %s, %d authorized client keys from %s", name, endpoint, len(authorized),
             authorized_dir)
    return admission
