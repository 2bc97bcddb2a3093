"""Checkpoint formats people already have, read into lightinfer's run-time layouts once at load.

* ``scheme``: which layout (W4 / W8 / dense) each linear gets, and its description.
* ``quant_config``: the check of a ``quantization_config`` (AWQ, GPTQ, compressed-tensors) and the
  per-module map built from the tensor names.
* ``gptq``, ``compressed_tensors``: one layer's tensors -> the run-time layout; ``packing``: shared parts.
* ``safetensors_load``: the pre-load check of every quantized layer and the streaming repack.
* ``gguf_file``, ``gguf_blocks``, ``gguf_load``: GGUF header, block unpacking and the tensor-by-tensor load.
* ``ct_writer``: compressed-tensors checkpoints written by ``lightinfer quantize --format compressed-tensors``.
"""
