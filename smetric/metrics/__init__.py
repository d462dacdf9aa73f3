"""The paper's metrics from a per-request table, whoever produced it: the simulator or a
measured replay against a live endpoint."""
