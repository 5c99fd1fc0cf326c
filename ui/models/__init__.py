"""*File → Models…*: the model catalog in a table (table.py), filled off the GUI thread by the
engine-side catalog command (runner.py), in a dialog that loads the chosen one (dialog.py)."""
