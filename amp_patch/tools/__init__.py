"""Command-line tools built on the library (cli, experiment, doctor, trace). The library never imports them."""
