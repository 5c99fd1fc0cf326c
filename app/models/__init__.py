"""The models on this machine, from the desktop side: the engine's catalog asked over a subprocess
(catalog.py), for `kvscope models`, names given to `--model` and the Models dialog."""
