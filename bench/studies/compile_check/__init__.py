"""Every kernel compiled for a CUDA target without a GPU, as a published result (``study``)."""
