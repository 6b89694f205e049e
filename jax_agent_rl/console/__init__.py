"""What the console shows: the progress of a long phase (`progress`) and model text made safe
to show (`visible`)."""
