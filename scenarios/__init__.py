"""The bundled scenarios: YAML files shipped as package data (read through importlib.resources)."""
