"""Block-granular copies between the device KV caches and host slots, one backend per module.

- :mod:`.base`: the :class:`~.base.CopyBackend` interface, ``Pair`` and ``check_pairs``, and
  what the backends share: bounded device staging, reused pinned index buffers, and what a
  backend derives per registration (views or raw pointers, held weakly).
- :mod:`.native_backend` (CPU): the small C extension ``_rowcopy``: one call per batch,
  streaming stores, no GIL held while it copies. Used whenever it was built.
- :mod:`.torch_backend`: batched index ops; on CUDA a gather/scatter on the device through
  one staging buffer in slot order, then one DMA per slot to or from pinned memory.
- :mod:`.cupy_backend`: one kernel launch per batch that moves every block of every layer
  straight between device memory and UVA-mapped pinned host memory.
- :mod:`.vllm_backend`: vLLM's own ``CopyBlocksOp`` (what ``set_host_xfer_buffer_ops``
  hands over), where it works.
- :mod:`.select`: ``select_backend``, the one place ``copy_backend`` is turned into one of them.

Import from the module that defines a name; this package re-exports nothing.
"""
