from mingru.bench import main

main()
