from dynamod.cli import main

main()
