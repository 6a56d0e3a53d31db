from .prompts import main

main()
