"""`nanoinfer eval`: numbers about a model, computed through the engine (one module per task)."""
