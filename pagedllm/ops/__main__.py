"""`python -m pagedllm.ops [-v]`: build the native CPU operators now (make venv runs it)."""

import logging
import sys

from pagedllm.ops.build import build, kernels_enabled

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if kernels_enabled():
        print(f"pagedllm CPU kernels: {build(verbose='-v' in sys.argv)}")
