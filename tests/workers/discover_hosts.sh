#!/bin/sh
# Horovod host discovery for elastic tests: the hosts and slots in $HC_SLOTS_FILE, one "host:slots" per line
# (hosts of this machine: localhost, 127.0.0.1).
cat "$HC_SLOTS_FILE"
