"""Tests of the pre-training job (``experiments/pretrain.py``, ``experiments/job/``), its studies
and its benchmarks' own code: the only tests that import ``experiments``."""
