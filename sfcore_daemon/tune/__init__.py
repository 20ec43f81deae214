"""`sfcore-daemon tune`: a command of its own that measures this machine and writes the
best settings into the config file. Main thread; never part of a serving daemon."""
