from dipaco.cli import main

main()
