#!/bin/sh
# Horovod host discovery for elastic tests: this machine, with as many slots as $HC_SLOTS_FILE says.
echo "localhost:$(cat "$HC_SLOTS_FILE")"
