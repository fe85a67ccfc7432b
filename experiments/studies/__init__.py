"""Studies built on the pre-training job's plan, apart from the job (which imports none)."""
