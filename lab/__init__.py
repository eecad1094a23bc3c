"""The cluster lab: pd-extproc's own request-side objects and vllmsim's engines in one process,
on a virtual clock (docs/lab.md)."""
