"""The worker: its node (node.py: the lifecycle and the parts), its faces (faces/: the collectives
and elastic training's calls), and the Worker that is made of them (runtime.py); beneath them the
data plane (dataplane/), the collectives' public side (ops/) and the control loops (control/)."""
