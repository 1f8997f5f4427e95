"""Put on PYTHONPATH (vs_vllm --no-amx) so vLLM's processes see a CPU without AMX tiles.

vLLM's CPU build picks its AMX kernels (attention, some linear paths) by asking
`torch.cpu._is_amx_tile_supported()`; oneDNN's GEMMs are held to AVX-512 BF16 by the
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` that vs_vllm sets beside this. Together they make an
AMX CPU run vLLM's code for AVX-512 BF16 CPUs without AMX (AMD Zen 4/5), as PAGEDLLM_CPU_AMX=0
does for pagedllm. Python imports this module at start-up in every process of that
environment, engine-core and workers included.
"""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
