"""torch.compile of the model (`compile.py`), driven by `compilation_config`."""
