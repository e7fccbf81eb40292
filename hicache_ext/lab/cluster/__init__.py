"""Cluster rehearsal on one machine: network-namespace nodes, their daemons and engines (issue 17)."""
