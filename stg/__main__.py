from stg.cli import main

main()
