"""Helpers of bench/peer_serving.py: peer install, server control, client, /proc sampling, report."""
