"""The pre-training job's modules; ``experiments/pretrain.py`` is its entry point."""
