"""An SGLang plug-in for the real-server tests only (tests/test_server_e2e.py): MLA on the CPU route.

tests/support/server.py puts this directory on the servers' PYTHONPATH, after the
CPU stand-ins (tests/cpu_server/stand_ins); SGLang loads the plug-in through its
``sglang.srt.plugins`` entry point in every server process.  The stand-ins make
SGLang's MHA host pool work on CPU; this does the same for MLA models:

- The MLA host pool is built unpinned (pinning needs CUDA) and gets the stand-ins'
  plain-torch ``transfer_kv_direct``, which serves the layer_first layout.  Not
  page_first_direct: SGLang's MLA backup for it calls
  ``transfer_kv_all_layer_direct_lf_pf`` with one buffer a layer (no K/V split),
  and the stand-ins' version of that function, written for MHA, would copy only
  half of the layers.
- With ``HICACHE_LAB_MLA_ABSORB`` set, DeepSeek attention under torch_native
  always takes the absorbed MLA path.  torch_native has no MLA handler of its
  own, so SGLang uses triton's, which runs a prefill without cached prefix as
  plain MHA over the expanded K/V; torch_native's extend reads K from the latent
  cache instead and fails ("Expected size for first two dimensions of batch2
  tensor to be: [4, 64] but got: [4, 96]").
"""
import os


def install():
    from sglang.srt.mem_cache.pool_host import mla

    import hicache_cpu_plugin  # the CPU stand-ins, on the same path

    mla.transfer_kv_direct = hicache_cpu_plugin.transfer_kv_direct
    cls = mla.MLATokenToKVPoolHost
    if not getattr(cls.__init__, "_hicache_unpinned", False):
        cls.__init__ = hicache_cpu_plugin._unpinned(cls.__init__)
        cls.__init__._hicache_unpinned = True
    if os.environ.get("HICACHE_LAB_MLA_ABSORB"):
        from sglang.srt.models.deepseek_common import attention_backend_handler as handler
        handler.AttentionBackendRegistry.register("torch_native",
                                                  lambda attn, batch: handler._dispatch_mla_subtype(attn, batch))
