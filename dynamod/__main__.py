from dynamod.control.cli import main

main()
