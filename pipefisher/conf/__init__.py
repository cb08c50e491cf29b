"""Hydra config groups of pipefisher (``conf/`` at the repository root links here)."""
