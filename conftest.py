pytest_plugins = ["portattn.testing.plugin"]
