"""The block manager's and the engine's host cost per operation (``study``; pytest-benchmark's
``benchmarks`` file), and other projects' block managers beside it (``peers``, each in a process of its own
running ``peer_worker.py``).
"""
