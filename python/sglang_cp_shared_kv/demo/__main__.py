from sglang_cp_shared_kv.demo.run import main

main()
