"""Training primitives over HTTP (issue 40): the Tinker protocol's wire format and built-in losses."""
