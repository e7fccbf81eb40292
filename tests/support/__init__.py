"""Helpers the test modules share (nodes and daemons to start, the engine side's setup, real servers, the
operator tools' processes); no test module imports another."""
