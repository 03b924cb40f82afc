"""The engine in a process of its own: the host that runs it, the worker's link to it, and the
wire format between the two."""
