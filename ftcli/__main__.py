from ftcli.cli import run

run()
