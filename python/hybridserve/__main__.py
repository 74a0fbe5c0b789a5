from hybridserve.cli import run

run()
