"""A worker's payload lanes: its port, the lanes its links offer and take, and their fallbacks
(hub.py); tcp/: the TCP payload lane."""
