from .cpu import main

main()
