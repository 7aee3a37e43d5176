"""An experiment's pieces built from its configuration: data, partition, model, algorithm
and execution settings."""
