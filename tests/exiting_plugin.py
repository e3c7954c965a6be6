"""A plugin module that calls ``exit()`` when imported (the registry tests load it)."""

message = "no GPU here"
raise SystemExit(message)
