"""Structured outputs: constrain sampling with a grammar so the output always parses.

Map of the package (one concept per module):
- `params`: `StructuredOutputsParams` / `GuidedDecodingParams`, what a request asks for.
- `backend_xgrammar`: spec -> xgrammar grammar (front-end validation), compiler, matchers.
- `manager`: `StructuredOutputManager`, the engine core's side (async compile, bitmasks,
  matcher advance); the Scheduler calls it.
- `bitmask`: applying the packed bitmask to the logits in the model runner.

Importing this package is cheap: xgrammar is imported when the first structured request comes.
"""

from pagedllm.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
