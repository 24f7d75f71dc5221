"""What pads a block-table row past a sequence's last block.

Its own module, free of torch and kernels, so that the host-side step inputs (and anything that only
builds metadata, such as the conformance suite's recorded engine steps) need not import the attention
backend and, through it, the kernels.
"""

#: block-table entries past a sequence's last block (never read by the kernels)
PAD_BLOCK_ID = 0
