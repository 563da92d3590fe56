"""Evidence: the files the probes write (reading and checking them) and the sealed cache of past runs."""
