"""`python -m pagedllm.ops [-v]`: build the native CPU operators now (`make venv` runs it).

A failed build is reported, not fatal: the engine then runs its pure-PyTorch path."""

import logging
import sys

from pagedllm.ops.build import build, kernels_enabled

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if kernels_enabled():
        try:
            print(f"pagedllm CPU kernels: {build(verbose='-v' in sys.argv)}")
        except Exception as e:  # no compiler / ninja: the PyTorch path remains
            print(f"pagedllm CPU kernels not built ({e}); the PyTorch path will be used")
