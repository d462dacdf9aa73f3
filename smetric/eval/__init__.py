"""The paper's evaluation as a plan of simulation runs (``smetric reproduce``).

Kept apart from ``sim`` (which knows nothing of the paper's figures or claims) and from
``report`` (which draws what this computes): here are the presets, the runs each figure
needs, and the numbers derived from them, set beside the ones the paper publishes.
"""
