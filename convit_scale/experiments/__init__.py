"""Runs anyone can do on a CPU: the demo (`convit-scale demo`) and the small replication of Table 2
(`convit-scale experiment sample-efficiency`)."""
