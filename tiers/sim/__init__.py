"""Trace-driven experiments: replay request traces through the daemons' eviction policies."""
