"""fedskew: federated learning under label and quantity skew."""

__version__ = "0.1.0"
