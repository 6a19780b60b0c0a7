"""storaged: a tiered checkpoint store for distributed training."""

__version__ = "0.1.0"
