"""The process group of tensor parallelism (`TensorGroup`, its collectives): a leaf under the model."""
