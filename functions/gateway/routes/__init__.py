"""One module per Tinker primitive family; each exposes `router`."""
