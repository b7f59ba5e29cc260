"""Where a run's model comes from: `resolve` turns a model spec into a local HF directory before
anything starts (tiny random models, the SmolLM2 GGUF, Hub ids from the local cache), `tiny` builds
the small random models of `miles tiny-model` and `--hf-checkpoint tiny:...`."""
