"""The `kvscope` command line: the one layer above both the engine (backend/) and the dashboard (frontend/)."""
